"""pallaskit: PyTorch Inductor's compiler ideas for JAX, rendered as Pallas kernels."""
from pallaskit import metrics
from pallaskit.api import JitFunction, jit
from pallaskit.config import config
from pallaskit.explain import explain, explain_grad
from pallaskit.runtime.eager import wait_compiles
from pallaskit.version import __version__
__all__ = ["jit", "explain", "explain_grad", "config", "metrics", "JitFunction", "wait_compiles", "__version__"]
