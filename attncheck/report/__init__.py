"""Results -> Rich tables, JSON, Markdown, JUnit and plots. Formatting only: no math, no torch."""
