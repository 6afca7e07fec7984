"""Every corpus in one place: reading documents from a list or a file (`reading`), the bundled King James Bible
(`verses`), the broad offline training corpus (`broad`), the corpora the model writes itself: chat, mixed, balanced
(`generated`), and training corpora by name (`named`). Imports only loading (the cache folder); the model it
generates with is passed in."""
