"""Tenants and their limits: the limits file, the ledger, the ledger's messages.

Pure logic (no sockets, no HTTP): the DP coordinator hosts the ledger for every
API server (`dpserve.launch.coordinator.tenants`), or an API server holds its own
(`dpserve.server.tenants`).
"""
