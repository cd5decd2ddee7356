"""RL algorithms: group advantages and policy losses."""
