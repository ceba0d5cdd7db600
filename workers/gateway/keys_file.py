"""The keys file (`--api-keys-file`, docs/gateway.md#tenants): the old format, one key per line, whose
keys have no tenant (their jobs are untagged and unlimited, exactly as before), or JSON / TOML naming
tenants, their limits and each key's tenant:

    {"tenants": {"acme": {"share": 3, "max_concurrent": 8, "tokens_per_minute": 200000}},
     "keys": {"sk-a...": "acme"}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clients.numbers import is_int, is_number
from clients.protocol import TENANT_RE
from workers.errors import UserError

_TOP_FIELDS = {"tenants", "keys"}
_TENANT_FIELDS = {"share", "max_concurrent", "tokens_per_minute", "min_priority"}


@dataclass(frozen=True)
class TenantLimits:
    share: float = 1.0  # weight of its fair share of the workers (written to `names.tenants`)
    max_concurrent: int = 0  # jobs pushed and not finished at once; 0: no bound
    tokens_per_minute: int = 0  # tokens charged per minute window (prompt + max output); 0: no bound
    # The most urgent `priority` its jobs may ask for (lower runs first). 0: none more urgent than the
    # default, so no tenant jumps the others' queue unless the operator allows it.
    min_priority: int = 0

    def __post_init__(self) -> None:  # the keys file is checked with better messages (parse_tenants)
        if not self.share > 0 or self.max_concurrent < 0 or self.tokens_per_minute < 0:
            raise ValueError(f"bad tenant limits {self}: share must be > 0, the bounds 0 or more")


@dataclass(frozen=True)
class KeysFile:
    """What `--api-keys-file` holds: every key, and for keys with a tenant, its tenant."""

    keys: tuple[str, ...]
    tenants: dict[str, TenantLimits] = field(default_factory=dict)
    key_tenants: dict[str, str] = field(default_factory=dict)


# --- the keys file -------------------------------------------------------------------------------

def read_keys_file(path: Path) -> KeysFile:
    """One key per line (`#` comments), or JSON (`.json`, or text starting with `{`) or TOML
    (`.toml`) with tenants. Raises UserError saying what is wrong and where."""
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read --api-keys-file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise UserError(f"--api-keys-file {path} is not UTF-8 text") from e
    kind = _format(path, text)
    if kind == "lines":
        lines = (ln.strip() for ln in text.splitlines())
        return KeysFile(tuple(ln for ln in lines if ln and not ln.startswith("#")))
    return parse_tenants(_decode(path, text, kind), f"--api-keys-file {path}")


def _format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".json", ".toml"):
        return suffix[1:]
    # A key never starts with `{`; a JSON object always does.
    return "json" if text.lstrip("\ufeff \t\r\n").startswith("{") else "lines"


def _decode(path: Path, text: str, kind: str) -> Any:
    try:
        if kind == "toml":
            return _toml_loads(text)
        # A key or tenant written twice is a mistake that json would silently resolve to the last one.
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except ValueError as e:  # tomllib.TOMLDecodeError is one
        raise UserError(f"--api-keys-file {path} is not valid {kind.upper()}: {e}") from e


def _toml_loads(text: str) -> Any:
    try:
        import tomllib  # the standard library's from Python 3.11; the project still runs on 3.10
    except ModuleNotFoundError as e:
        raise UserError("a TOML --api-keys-file needs Python 3.11 or later: write it as JSON instead") from e
    return tomllib.loads(text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"{k[:4] + '...' if len(k) > 8 else k!r} is given twice")
        out[k] = v
    return out


def parse_tenants(data: Any, where: str) -> KeysFile:
    """The decoded JSON / TOML document -> KeysFile. `where` starts every error message."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be an object with `tenants` and `keys`")
    _no_unknown(data, _TOP_FIELDS, where)
    tenants_raw = data.get("tenants", {})
    if not isinstance(tenants_raw, dict):
        raise UserError(f"{where}: `tenants` must be an object: tenant name -> its limits")
    tenants = {name: _tenant(name, spec, where) for name, spec in tenants_raw.items()}
    keys_raw = data.get("keys")
    if not isinstance(keys_raw, dict) or not keys_raw:
        # No key at all would leave the gateway open to anyone: never what such a file means.
        raise UserError(f"{where}: `keys` must be a non-empty object: API key -> tenant name")
    key_tenants = {_key(k, where): _key_tenant(k, t, tenants, where) for k, t in keys_raw.items()}
    return KeysFile(tuple(key_tenants), tenants, key_tenants)


def _no_unknown(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _tenant(name: Any, spec: Any, where: str) -> TenantLimits:
    if not isinstance(name, str) or not TENANT_RE.match(name):
        raise UserError(f"{where}: tenant name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-'")
    at = f"{where}: tenants.{name}"
    if not isinstance(spec, dict):
        raise UserError(f"{at} must be an object with share, max_concurrent, tokens_per_minute, min_priority")
    _no_unknown(spec, _TENANT_FIELDS, at)
    share = spec.get("share", 1)
    if not is_number(share) or not math.isfinite(share) or share <= 0:
        raise UserError(f"{at}.share must be a positive number, got {share!r}")
    min_priority = spec.get("min_priority", 0)
    if not is_int(min_priority) or not -2**31 <= min_priority <= 2**31:
        raise UserError(f"{at}.min_priority must be a whole number from -2147483648 to 2147483648, got "
                        f"{min_priority!r}")
    return TenantLimits(float(share), _count(spec, "max_concurrent", at), _count(spec, "tokens_per_minute", at),
                        min_priority)


def _count(spec: dict[str, Any], name: str, at: str) -> int:
    value = spec.get(name, 0)
    if not is_int(value) or not 0 <= value < 2**53:
        raise UserError(f"{at}.{name} must be a whole number, 0 or more (0: no bound), got {value!r}")
    return value


def _key(key: Any, where: str) -> str:
    # Keys travel in `Authorization: Bearer KEY` and `?token=KEY`: whitespace could never match.
    if not isinstance(key, str) or not key or key != key.strip() or any(c.isspace() for c in key):
        raise UserError(f"{where}: every API key must be a non-empty string without spaces")
    return key


def _key_tenant(key: str, tenant: Any, tenants: dict[str, TenantLimits], where: str) -> str:
    if tenant not in tenants:
        shown = key[:4] + "..." if len(key) > 8 else "a key"  # never the whole key in a log line
        raise UserError(f"{where}: {shown} names tenant {tenant!r}, which is not in `tenants` "
                        f"({sorted(tenants)})")
    return str(tenant)
