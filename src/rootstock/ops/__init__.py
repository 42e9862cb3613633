"""One function per user-visible operation. Operations return results; they never print."""
