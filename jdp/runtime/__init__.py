"""The process and the job: joining a multi-process job (`distributed`), never hanging
(`watchdog`), preemption notices, exit statuses, the compilation cache, and the one
module that touches jax's private modules (`jax_private`)."""
