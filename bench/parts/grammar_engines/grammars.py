"""The grammar-engine benchmark's cases: JSON schemas, regexes, choices, EBNF/Lark grammars, and the
documents each must accept (bench/grammar_engines.py)."""

from __future__ import annotations

import json
import random
from typing import Any

LIBRARIES = ("xgrammar", "llguidance", "outlines-core")
DIST_NAMES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}


# ---- the grammars ---------------------------------------------------------------------------

def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object (no extra keys, the same meaning in all three libraries)."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


_NUM, _INT, _STR, _BOOL = {"type": "number"}, {"type": "integer"}, {"type": "string"}, {"type": "boolean"}
_DATE_TIME = {"type": "string", "format": "date-time"}

SCHEMA: dict = {"title": "Order", **_obj({
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "created_at": _DATE_TIME,
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "gift": _BOOL,
    "customer": _obj({
        "id": _INT,
        "name": {"type": "string", "maxLength": 60},
        "email": {"type": "string", "format": "email"},
        "tier": {"enum": ["free", "plus", "pro"]},
        "address": _obj({
            "street": _STR, "city": _STR, "postal_code": _STR,
            "country": {"enum": ["DE", "FR", "GB", "US", "JP"]},
            "geo": _obj({"lat": _NUM, "lon": _NUM, "accuracy": {"enum": ["exact", "street", "city"]}}),
        }),
    }),
    "items": {"type": "array", "minItems": 1, "items": _obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": _STR,
        "quantity": {"type": "integer", "minimum": 1},
        "unit_price": _NUM,
        "tags": {"type": "array", "items": _STR, "maxItems": 3},
        "dimensions": _obj({"width": _NUM, "height": _NUM, "depth": _NUM, "unit": {"enum": ["cm", "in"]}}),
    }, ["sku", "name", "quantity", "unit_price", "dimensions"])},
    "shipping": _obj({
        "method": {"enum": ["standard", "express", "pickup"]},
        "carrier": _STR,
        "tracking": _obj({
            "number": _STR,
            "events": {"type": "array", "items": _obj({
                "timestamp": _DATE_TIME, "location": _STR,
                "code": {"enum": ["created", "picked_up", "in_transit", "delivered"]},
            })},
        }),
    }),
    "payment": _obj({"method": {"enum": ["card", "paypal", "invoice"]}, "amount": _NUM,
                     "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]}, "captured": _BOOL}),
    "notes": {"anyOf": [_STR, {"type": "null"}]},
    "metadata": _obj({"source": {"enum": ["web", "app", "phone"]},
                      "campaign": {"anyOf": [_STR, {"type": "null"}]}, "version": _INT}, ["source", "version"]),
}, ["order_id", "status", "created_at", "priority", "customer", "items", "shipping", "payment"])}

REGEX_DATE_TIME = (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d"
                   r"(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})")
REGEX_EMAIL = r"[a-z0-9._%+-]{1,64}@[a-z0-9-]{1,63}(\.[a-z0-9-]{1,63})*\.[a-z]{2,12}"
CHOICES = ["positive", "negative", "neutral", "mixed", "not applicable"]
# The same arithmetic grammar in each library's dialect: GBNF-style EBNF (xgrammar), Lark (llguidance).
EBNF_ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")" | "-" factor
number ::= [0-9]+ ("." [0-9]+)?
"""
LARK_ARITH = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""

# case name -> what it is, in the table
CASES = {
    "json_schema": "nested JSON schema (49 props)",
    "json_object": "any JSON object",
    "regex_datetime": "regex: ISO date-time",
    "regex_email": "regex: email-like",
    "choice5": "choice of 5 strings",
    "ebnf_arith": "EBNF: arithmetic",
}

_WORDS = ["alpha", "bravo", "Köln", "straße", "north", "quick", "blue", "parcel", "fragile", "Zürich", "depot",
          "express", "café", "gate 7", "warehouse", "12b", "left", "dock", "night", "München", "spare"]


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def _stamp(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:" \
           f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


def make_order(rng: random.Random) -> dict:
    """A random instance of SCHEMA (properties in schema order, some optional ones left out)."""
    doc: dict[str, Any] = {
        "order_id": f"ORD-{rng.randint(0, 999999):06d}",
        "status": rng.choice(SCHEMA["properties"]["status"]["enum"]),
        "created_at": _stamp(rng),
        "priority": rng.randint(1, 5),
    }
    if rng.random() < 0.5:
        doc["gift"] = rng.random() < 0.5
    doc["customer"] = {
        "id": rng.randint(1, 10**7), "name": _text(rng, 1, 3),
        "email": f"{rng.choice(_WORDS[:2])}.{rng.randint(1, 999)}@example.com",
        "tier": rng.choice(["free", "plus", "pro"]),
        "address": {"street": f"{_text(rng, 1, 2)} {rng.randint(1, 200)}", "city": rng.choice(_WORDS),
                    "postal_code": f"{rng.randint(10000, 99999)}",
                    "country": rng.choice(["DE", "FR", "GB", "US", "JP"]),
                    "geo": {"lat": round(rng.uniform(-90, 90), 4), "lon": round(rng.uniform(-180, 180), 4),
                            "accuracy": rng.choice(["exact", "street", "city"])}},
    }
    items = []
    for _ in range(rng.randint(1, 3)):
        item: dict[str, Any] = {"sku": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3))
                                + f"-{rng.randint(0, 9999):04d}",
                                "name": _text(rng, 1, 3), "quantity": rng.randint(1, 20),
                                "unit_price": round(rng.uniform(0.5, 500), 2)}
        if rng.random() < 0.6:
            item["tags"] = [rng.choice(_WORDS) for _ in range(rng.randint(0, 3))]
        item["dimensions"] = {"width": round(rng.uniform(1, 100), 1), "height": round(rng.uniform(1, 100), 1),
                              "depth": round(rng.uniform(1, 100), 1), "unit": rng.choice(["cm", "in"])}
        items.append(item)
    doc["items"] = items
    doc["shipping"] = {
        "method": rng.choice(["standard", "express", "pickup"]), "carrier": rng.choice(["DHL", "UPS", "La Poste"]),
        "tracking": {"number": f"{rng.randint(10**9, 10**10)}", "events": [
            {"timestamp": _stamp(rng), "location": rng.choice(_WORDS),
             "code": rng.choice(["created", "picked_up", "in_transit", "delivered"])}
            for _ in range(rng.randint(0, 2))]},
    }
    doc["payment"] = {"method": rng.choice(["card", "paypal", "invoice"]), "amount": round(rng.uniform(1, 2000), 2),
                      "currency": rng.choice(["EUR", "USD", "GBP", "JPY"]), "captured": rng.random() < 0.7}
    if rng.random() < 0.5:
        doc["notes"] = _text(rng, 2, 6) if rng.random() < 0.7 else None
    if rng.random() < 0.7:
        meta: dict[str, Any] = {"source": rng.choice(["web", "app", "phone"])}
        if rng.random() < 0.5:
            meta["campaign"] = rng.choice([None, "winter-sale", "newsletter"])
        meta["version"] = rng.randint(1, 9)
        doc["metadata"] = meta
    return doc


def documents(case: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct valid outputs for a case."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if case == "json_schema":
            out.append(json.dumps(make_order(rng), ensure_ascii=False))
        elif case == "json_object":  # a generic object, 3 levels deep (outlines-core's default depth limit)
            out.append(json.dumps({"id": i, "title": _text(rng, 2, 5), "score": round(rng.uniform(0, 1), 3),
                                   "tags": [rng.choice(_WORDS) for _ in range(rng.randint(1, 4))],
                                   "author": {"name": _text(rng, 1, 2), "verified": rng.random() < 0.5,
                                              "stats": {"posts": rng.randint(0, 999), "karma": None}}},
                                  ensure_ascii=False))
        elif case == "regex_datetime":
            out.append(_stamp(rng).replace("Z", rng.choice(["Z", ".125+02:00", "-05:30"])))
        elif case == "regex_email":
            out.append(f"{rng.choice(['ada', 'grace.hopper', 'linus_t'])}{rng.randint(1, 99)}@"
                       f"{rng.choice(['example', 'mail-server'])}.{rng.choice(['com', 'co.uk', 'org'])}")
        elif case == "choice5":
            out.append(rng.choice(CHOICES))
        elif case == "ebnf_arith":
            out.append(f"({rng.randint(1, 99)}+{rng.uniform(0, 9):.2f})*{rng.randint(2, 9)}-"
                       f"{rng.randint(1, 999)}/(-{rng.randint(1, 9)}+({rng.randint(1, 50)}*2.5-1))")
    return out
