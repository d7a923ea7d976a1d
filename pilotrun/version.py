"""The package version, in a module of its own so that any folder can name it without importing the
package's front door (pilotrun/__init__.py, which resolves the API lazily)."""

__version__ = "0.1.0"
