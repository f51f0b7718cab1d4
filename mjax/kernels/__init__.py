"""Hot-path ops behind one dispatch point each; every op has a pure-JAX reference that is the test oracle."""
