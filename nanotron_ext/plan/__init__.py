"""The planner: ranks of a config's real layout built and stepped in one machine, nothing real allocated
(`python -m nanotron_ext.plan`; nanotron_ext/plan/__main__.py says what it prints)."""
