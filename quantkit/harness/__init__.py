"""The harness behind `quantkit eval`, `bench`, `report` and `advise`: quality, timing, roofline, results files,
report and plots (ARCHITECTURE.md)."""
