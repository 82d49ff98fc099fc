"""JSON renderer of the report model."""
from __future__ import annotations

import json
from typing import Any, Dict


def render_json(report: Dict[str, Any]) -> str:
    return json.dumps(report, indent=2, allow_nan=False) + "\n"
