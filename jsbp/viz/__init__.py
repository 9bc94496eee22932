"""Pictures of layouts, boxings, plans, ring schedules and expert dispatches, for Jupyter (HTML)
and terminals (text).

``GlobalTensor._repr_html_`` and ``placement._repr_html_`` call into this package lazily, so the
core never imports it. Every HTML picture is self-contained (inline CSS and SVG: no script, no
external fetch) and readable on light and dark themes; no plotting library is needed.
"""

from ._boxing import boxing_html as boxing_html
from ._boxing import boxing_steps as boxing_steps
from ._boxing import boxing_text as boxing_text
from ._dispatch import ExpertDispatch as ExpertDispatch
from ._dispatch import expert_dispatch as expert_dispatch
from ._dispatch import expert_dispatch_html as expert_dispatch_html
from ._dispatch import expert_dispatch_text as expert_dispatch_text
from ._placement import placement_html as placement_html
from ._placement import placement_text as placement_text
from ._plan import plan_html as plan_html
from ._plan import plan_text as plan_text
from ._ring import ring_schedule as ring_schedule
from ._ring import ring_schedule_html as ring_schedule_html
from ._ring import ring_schedule_text as ring_schedule_text
from ._tensor import tensor_html as tensor_html
from ._tensor import tensor_text as tensor_text

__all__ = [
    "tensor_html",
    "tensor_text",
    "placement_html",
    "placement_text",
    "boxing_html",
    "boxing_text",
    "boxing_steps",
    "plan_html",
    "plan_text",
    "ring_schedule",
    "ring_schedule_html",
    "ring_schedule_text",
    "expert_dispatch",
    "expert_dispatch_html",
    "expert_dispatch_text",
    "ExpertDispatch",
]
