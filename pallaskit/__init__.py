"""pallaskit: PyTorch Inductor's compiler ideas for JAX, rendered as Pallas kernels."""
from pallaskit import metrics
from pallaskit.api import JitFunction, jit
from pallaskit.config import config
from pallaskit.explain import explain

__version__ = "0.1.0"
__all__ = ["jit", "explain", "config", "metrics", "JitFunction", "__version__"]
