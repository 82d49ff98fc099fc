"""JSON renderer: a `Record` as its ``guard-report/1`` document."""
from __future__ import annotations

import json
from typing import Union

from ..record import Record


def render_json(record: Union[Record, dict]) -> str:
    """The dump's text; a dict (already the document) is written as it is."""
    data = record if isinstance(record, dict) else record.to_json()
    return json.dumps(data, indent=2, allow_nan=False) + "\n"
