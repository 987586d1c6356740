"""The rewrite passes, one module each; installed as ``ulysses_compile.passes``."""
