"""What the passes build on: placements (``sharding``), sizes, the collectives and the runtime ops a
rewritten graph calls, the op table, FX helpers, reports, options, errors and the one door to torch's
private APIs (``compat``). Nothing here imports the passes or the front doors."""
