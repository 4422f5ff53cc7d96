"""The quickstart: the whole job (regenerate, cache features, train, measure τ) on SmolLM2-135M, one command."""
