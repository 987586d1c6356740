"""The rewrite passes, one module each, and the pipeline that runs them in order. They build on
``ulysses_compile.core`` and import nothing from the front doors (``ulysses_compile``'s own modules)."""
