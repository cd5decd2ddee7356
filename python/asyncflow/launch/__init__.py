"""Launchers place the workers: ``local`` runs them as threads of this process."""
