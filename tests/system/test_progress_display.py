"""workers/progress_display.py: a bar on a terminal, one plain line when piped; the model
conversion's de-quantizing shown through it (on a tiny GGUF file written here), no foreign bar."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from workers.progress_display import task

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
DONE = r"counting: 10/10 done in \d+\.\ds"
# Half the work done, a pause long enough for the bar to be redrawn (4 times a second), a row printed
# to stdout while the bar is shown, the rest.
SCRIPT = """
import sys, time
from workers.progress_display import task
with task("counting", total=10) as bar:
    bar.advance(5)
    time.sleep(float(sys.argv[1]))
    print("row 1", flush=True)
    bar.advance(5)
print("result: 42")
"""


def terminal_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_PROGRESS"}
    return {**env, "TERM": "xterm-256color", "COLUMNS": "100", "PYTHONPATH": str(ROOT), **extra}


def read_pty(fd: int, chunks: list[bytes], deadline: float, until: Callable[[bytes], bool] | None = None) -> None:
    """Read a pty's master side until the other side is closed (EIO), the deadline, or `until(all so far)`."""
    while time.monotonic() < deadline and not (until and until(b"".join(chunks))):
        if not select.select([fd], [], [], 0.1)[0]:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        chunks.append(data)


def _open_pty() -> tuple[int, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    return master, slave


def pty_output(argv: list[str], env: dict[str, str], timeout: float = 30) -> str:
    """A command's output with stdin, stdout and stderr on one pseudo-terminal, as a terminal gets it
    (it must exit with 0)."""
    master, slave = _open_pty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT)
    os.close(slave)
    chunks: list[bytes] = []
    read_pty(master, chunks, time.monotonic() + timeout)
    os.close(master)
    assert proc.wait(10) == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode().replace("\r\n", "\n")


def run_in_pty(*args: str, **env: str) -> str:
    """SCRIPT's output on a pseudo-terminal."""
    return pty_output([sys.executable, "-c", SCRIPT, *args], terminal_env(**env))


def screen(raw: str) -> list[str]:
    """The non-empty lines a terminal shows after `raw`: a small emulator of what rich sends (text,
    carriage return, line feed, erase line, cursor up; colours and the cursor's visibility ignored)."""
    rows, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            rows += [""] * (row + 1 - len(rows))
        elif token.endswith("A") and token.startswith("\x1b["):
            row = max(0, row - int(token[2:-1] or 1))
        elif token.endswith("K") and token.startswith("\x1b["):
            rows[row] = ""
        elif not token.startswith("\x1b"):
            line = rows[row].ljust(col)
            rows[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return [line.rstrip() for line in rows if line.strip()]


def test_a_terminal_gets_a_bar_then_one_done_line() -> None:
    raw = run_in_pty("0.6")
    text = ANSI.sub("", raw)
    assert "\x1b[" in raw and "━" in text, raw  # a live, drawn bar
    assert "counting" in text and "5/10" in text and "50%" in text, text
    shown = screen(raw)
    # print() to the same terminal lands above the bar as a whole line; the bar is erased at the end
    # and replaced by the one summary line.
    assert len(shown) == 3 and shown[0] == "row 1" and re.fullmatch(DONE, shown[1]), shown
    assert shown[2] == "result: 42"


def test_piped_output_has_no_escapes_and_only_the_summary_line() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, "0"], capture_output=True, text=True, env=terminal_env(),
                          cwd=ROOT, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "row 1\nresult: 42\n"  # the results themselves, untouched
    assert re.fullmatch(DONE + "\n", done.stderr), done.stderr
    assert "\x1b" not in done.stdout + done.stderr


def test_streamer_progress_forces_the_display_off_and_on() -> None:
    off = run_in_pty("0", STREAMER_PROGRESS="0")
    assert re.fullmatch(r"row 1\n" + DONE + r"\nresult: 42\n", off), off  # plain, on a terminal
    on = subprocess.run([sys.executable, "-c", SCRIPT, "0"], capture_output=True, text=True,
                        env=terminal_env(STREAMER_PROGRESS="1"), cwd=ROOT, timeout=30)
    assert "\x1b[" in on.stderr and "━" in on.stderr and "/10" in on.stderr, on.stderr  # a bar, piped
    assert on.stdout == "row 1\nresult: 42\n"


def test_summary_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMER_PROGRESS", raising=False)
    out = io.StringIO()
    with task("outer", total=2, stream=out) as outer:
        with task("inner", stream=out) as inner:
            inner.advance(3)
        outer.advance()
        with task("quiet", total=1, stream=out, summary=False) as quiet:
            quiet.advance()
        outer.update(completed=2, description="outer, renamed")
    with pytest.raises(ValueError), task("broken", total=4, stream=out) as broken:
        broken.advance()
        raise ValueError
    lines = out.getvalue().splitlines()
    assert [re.sub(r"\d+\.\ds", "T", line) for line in lines] == [
        "inner: 3 done in T", "outer, renamed: 2/2 done in T", "broken: 1/4 failed after T"], lines
    with task("spinner only", stream=out):
        pass
    assert re.fullmatch(r"spinner only: done in \d+\.\ds", out.getvalue().splitlines()[-1]), out.getvalue()


# --- the model conversion's bar --------------------------------------------------------------------

def tiny_gguf(tmp_path: Path) -> tuple[Path, object, set[str]]:
    """A 2-layer Llama as a GGUF file (float32 tensors), the meta-device model it loads into, and the
    parameter names the reader must return."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, vocab, heads, kv_heads = 2, 32, 64, 64, 4, 2
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    kv = hidden // heads * kv_heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                   f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                   f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                   f"blk.{i}.ffn_gate.weight": (inter, hidden), f"blk.{i}.ffn_up.weight": (inter, hidden),
                   f"blk.{i}.ffn_down.weight": (hidden, inter)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    assert len(shapes) == 20
    return path, skeleton, set(skeleton.state_dict()) - {"lm_head.weight"}


def test_conversion_shows_a_spinner_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert_gguf's de-quantizing step, as it runs it (workers.default_model.dequantize), with
    stderr on a pseudo-terminal: our spinner with the elapsed time shows; the GGUF reader's tqdm bar,
    which it would draw there too, does not appear."""
    from workers.default_model import dequantize

    path, skeleton, expected = tiny_gguf(tmp_path)
    monkeypatch.delenv("STREAMER_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "100")
    master, slave = _open_pty()
    chunks: list[bytes] = []
    reader = threading.Thread(target=read_pty, args=(master, chunks, time.monotonic() + 30))
    reader.start()
    terminal = os.fdopen(slave, "w")
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", terminal)
            tensors = dequantize(path, skeleton)
    finally:
        terminal.close()
        reader.join(30)
        os.close(master)
    assert set(tensors) == expected
    raw = b"".join(chunks).decode().replace("\r\n", "\n")
    text = ANSI.sub("", raw)
    assert re.search(r"de-quantizing weights .*\d:\d\d:\d\d", text), text
    assert "Converting and de-quantizing" not in text and "it/s" not in text, text
    assert screen(raw) == [], raw[-300:]  # erased at the end, no line left


def test_conversion_prints_nothing_when_piped(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.default_model import dequantize

    monkeypatch.delenv("STREAMER_PROGRESS", raising=False)
    path, skeleton, expected = tiny_gguf(tmp_path)
    assert set(dequantize(path, skeleton)) == expected
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
