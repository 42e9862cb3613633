"""The release's version, in a module of its own.

Code that needs the version imports it from here, not from the package root: the
root loads the calculator on first access, so importing the root from inside the
package would tie every such module into an import cycle with the runtime.
"""

from __future__ import annotations

__version__ = "0.1.0"
