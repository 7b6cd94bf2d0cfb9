"""groundup: the package behind *Transformers from the Ground Up*.

Every chapter of the book builds one component from first principles; the final version of each lives
here, one module per concept, so that later chapters import earlier ones instead of copying them.
"""

from groundup.utils import default_device, set_seed

__version__ = "0.1.0"
__all__ = ["__version__", "default_device", "set_seed"]
