"""Framework integrations (optional extras): ``guard.integrations.lightning``, ``guard.integrations.transformers``."""
