"""Reports that read a Plan and never plan: text, HTML, DOT/SVG, explain/diff, estimates, and the
``parallelize_module`` export."""
