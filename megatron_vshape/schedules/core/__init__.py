"""The schedule model: actions, schedules, costs and memory, dependencies, timing and the simulator."""
