"""The recipe test kit's checks, one module per kind. Import them from ``mvp_engine.engine.testing``; the pytest
suites from ``mvp_engine.engine.testkit.suites``."""
