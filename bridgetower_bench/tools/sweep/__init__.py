"""The benchmark sweep's report, its costs and energy, and the versions its rows ran (the commands stay in tools/)."""
