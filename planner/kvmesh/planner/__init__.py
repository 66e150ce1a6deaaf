"""The SLA planner (not built yet)."""
