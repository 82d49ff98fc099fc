"""JSON renderer: a `Record` as its ``guard-report/1`` document."""
from __future__ import annotations

import json
from typing import Any, Union

from ..findings import printable
from ..record import Record


def render_json(record: Union[Record, dict]) -> str:
    """The dump's text; a dict (already the document) is written as it is."""
    data = record if isinstance(record, dict) else record.to_json()
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if "\\ud" in text:
        # a lone surrogate (a non-UTF-8 path or argument, as Python decodes it) written as \udcff is
        # valid for Python's json but not for strict parsers (RFC 8259): written as its escape text instead
        text = json.dumps(_no_surrogates(data), indent=2, allow_nan=False) + "\n"
    return text


def _no_surrogates(v: Any) -> Any:
    if isinstance(v, str):
        return printable(v)
    if isinstance(v, dict):
        return {_no_surrogates(k): _no_surrogates(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_no_surrogates(x) for x in v]
    return v
