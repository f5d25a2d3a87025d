"""Sans-IO core: stdlib + msgspec only (no anyio, asyncio, torch, socket, time)."""
