"""The ``autotp`` command line. Importing this package imports no torch: ``autotp --help`` is fast."""
