"""Reliability: faults injected into real daemons and clients (``faults.py``), a soak of many
concurrent clients (``soak.py``), and the report that tabulates them (``report.py``), run by
``asyncflow reliability`` (``make reliability``)."""
