"""Adapters that run other programming models on the server (today: asyncio protocols)."""
