"""The verify server: hosts the target LLM, verifies edge draft trees, sends memory rows (see server.app)."""
