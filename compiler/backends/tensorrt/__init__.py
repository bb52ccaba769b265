"""TensorRT, in one folder: building engines, checking where they run, and serving them.

Building (``trtc build`` / ``trtc rebuild``), in the order a build runs:

* ``versions``: which TensorRT trtc supports (10.12 to 11.x) and the strongly typed network flag;
* ``profiles``: the min/opt/max shapes of each optimization profile;
* ``loaders``: the Polygraphy loader chain of one engine, constructed without TensorRT;
* ``build_step``: TensorRT builds the engine (and names the ONNX nodes its parser rejects);
* ``layers``: the engine inspector's layer information and its summary;
* ``timing_cache``: the directory's and the shared tactic timing caches;
* ``build``: ``build_engine_files``, the stage: every engine of a directory, in worker processes with ``--jobs``,
  returning the manifest's engine records (``compiler.core.manifest`` stores them and the build settings).

Running: ``environment`` (TensorRT, CUDA, the GPU that builds or runs, platform), ``compat`` (whether an engine
built in one environment runs in another: ``trtc check``) and ``runtime`` (the ``tensorrt`` serving backend).
Both: ``logger``, the one TensorRT logger of the process (Polygraphy's).

TensorRT itself is imported only inside the functions that call it, so every module here imports, and
everything but the build step and the runtime runs, where TensorRT is not installed.
"""
