"""How a run is laid out: devices, the plan, the RunLayout, and the resolution that fills it."""
