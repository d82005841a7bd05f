"""Prefill/decode disaggregation: the KV connector (``connector``), its socket transport (``transport``), the
byte accounting of what moves (``accounting``) and the router in front of both kinds of instance (``router``).

Importing this package imports no torch: ``dsserve router`` runs on a base install without it.
"""
