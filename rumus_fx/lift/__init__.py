"""Any JAX program on the tape: ``rf.lift``, ``rf.checkpoint`` and the
per-primitive rules (one module per family; importing them declares the rules)."""

from ..autograd import engine as _engine
from ..autograd import transforms as _transforms
from . import budget as budget
from . import higher as _higher
from . import rules_complex as rules_complex
from . import rules_control as rules_control
from . import rules_conv as rules_conv
from . import rules_custom as rules_custom
from . import rules_elementwise as rules_elementwise
from . import rules_fft as rules_fft
from . import rules_indexing as rules_indexing
from . import rules_linalg as rules_linalg
from . import rules_parallel as rules_parallel
from . import rules_reduce as rules_reduce
from . import rules_special as rules_special
from . import rules_structural as rules_structural
from .library import defrule as defrule
from .library import undefrule as undefrule
from .lifted_record import LiftedBackward as LiftedBackward
from .program import Program as Program
from .remat import checkpoint as checkpoint
from .rules import NON_DIFFERENTIABLE as NON_DIFFERENTIABLE
from .rules import RULES as RULES
from .rules import PrimitiveRecord as PrimitiveRecord
from .tracing import lift as lift

_engine.CREATE_GRAPH = _higher.recorded_backward  # Note [Create graph] in higher.py
_transforms.set_lift(lift)  # the nested transforms run lifted (Note [Higher order])
