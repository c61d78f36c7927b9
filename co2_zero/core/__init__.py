"""The algorithm: configuration, the resolved plan and support table, the round engine, the exchange and the
outer step (docs/design.md §10). It imports no framework."""
