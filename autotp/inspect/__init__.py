"""Reports that read a Plan and never plan: explain/diff, estimates, HTML, DOT/SVG, and the
``parallelize_module`` export. Each is a function of the plan (``autotp.explain(plan, name)``...),
so planning never imports a report; the plan's own text (``print(plan)``) lives with the plan
(:func:`autotp.planning.plan.plan_summary`)."""

from autotp.inspect.dot import to_dot, to_svg
from autotp.inspect.estimates import estimate
from autotp.inspect.explanations import diff, explain
from autotp.inspect.html import to_html
from autotp.inspect.parallelize_plan import to_parallelize_plan

__all__ = ["diff", "estimate", "explain", "to_dot", "to_html", "to_parallelize_plan", "to_svg"]
