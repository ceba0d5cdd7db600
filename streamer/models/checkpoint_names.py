"""How a Hugging Face decoder checkpoint's tensor names map onto the engine's parameters."""

from __future__ import annotations

from typing import Any


class HFCheckpointNames:
    """For models whose q/k/v and gate/up projections are fused into one parameter each
    (`qkv_proj`, `gate_up_proj`): each separate checkpoint tensor is loaded as its shard. A
    checkpoint that is already fused (Phi-3) passes through with no shard id: the layer's loader
    splits it. `tied`: the LM head is the embedding, so a stored lm_head.weight is skipped."""

    tied: bool
    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def checkpoint_name_to_param(self, name: str) -> tuple[str, Any] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id); None = not ours."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and self.tied:
            return None
        for fragment, (ours, shard_id) in self.stacked_params.items():
            if fragment in name:
                return name.replace(fragment, ours), shard_id
        return name, None
