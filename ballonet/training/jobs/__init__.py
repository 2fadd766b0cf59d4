"""Jobs: a run's ranks launched, their host settings, their stop at a step boundary."""
