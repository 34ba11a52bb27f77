# One image for every role: `kvpool operator`, `kvpool store`, `kvpool sidecar` (and `kvpool loadgen`,
# `kvpool router-api`). Build and push it to your registry (README, "The image"):
#   docker build -t REGISTRY/kvpool:TAG . && docker push REGISTRY/kvpool:TAG
# tools/image.sh builds this same file here with buildah, into an OCI archive.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Everything kvpool runs goes into one venv, copied whole into the final stage: pip and the build
# tools stay behind in this stage.
RUN python -m venv /opt/kvpool/venv
WORKDIR /src
# The dependencies first, from pyproject.toml alone: their layer survives edits of the sources.
# Extras: the operator's, and the KV events' (store nodes publish them when a KVPool asks,
# spec.router.events).
COPY pyproject.toml ./
RUN /opt/kvpool/venv/bin/pip install $(python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; print(' '.join(p['dependencies'] + x['operator'] + x['events']))")
COPY README.md ./
COPY sidecar ./sidecar
COPY operator ./operator
# Then kvpool itself; then out go what nothing imports: the venv's own pip and setuptools, the
# dependencies' test suites (numpy's alone are 20 MB), and the kubernetes client's asyncio copy
# of itself (68 MB; the operator uses its REST layer, kopf its own aiohttp client).
RUN /opt/kvpool/venv/bin/pip install --no-deps ".[operator,events]" \
 && /opt/kvpool/venv/bin/pip uninstall -y -q pip setuptools \
 && find /opt/kvpool/venv/lib -depth -type d -name tests -path '*/site-packages/*/tests' -exec rm -rf {} + \
 && rm -rf /opt/kvpool/venv/lib/python3*/site-packages/kubernetes/aio

FROM python:3.11-slim
# A fixed gid: `USER 65532:65532` alone ran with gid 999 under containerd, which takes the primary
# group from /etc/passwd, where `useradd --system` had picked 999.
RUN groupadd --system --gid 65532 kvpool \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin kvpool
COPY --from=build /opt/kvpool/venv /opt/kvpool/venv
# Bytecode is compiled at install; the root filesystem is read-only in the pods, so none is written.
ENV PATH=/opt/kvpool/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# The startup probe of injected sidecars runs `test -S` (coreutils, in the base image).
USER 65532:65532
EXPOSE 7400 7401 8080 9090 9443
ENTRYPOINT ["kvpool"]
CMD ["--help"]
