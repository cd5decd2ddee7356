"""The RL tasks as independent workers that talk only through the store."""
