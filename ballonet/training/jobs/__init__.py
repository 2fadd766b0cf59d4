"""Jobs: a run's ranks launched, their host settings, their process group, their stop at a step boundary."""
