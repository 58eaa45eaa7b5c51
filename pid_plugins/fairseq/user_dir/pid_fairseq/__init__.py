# fairseq --user-dir entry point: the directory name must be unique among importable modules.
import pid_plugins.fairseq  # noqa: F401  (registers transformer_lm_pid and its architectures)
pid_plugins.catalogue.load_installed_methods()  # the methods of installed packages (group pid_plugins.methods)
