"""Tools around plans: check-plan, the coverage table, the families' tiny examples."""
