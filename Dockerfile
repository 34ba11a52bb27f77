# One image for every role: `kvpool operator`, `kvpool store`, `kvpool sidecar` (and `kvpool loadgen`).
#   docker build -t ghcr.io/kvpool/kvpool:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY operator ./operator
RUN pip install --no-cache-dir --upgrade pip \
 && pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:3.11-slim
# The startup probe of injected sidecars runs `test -S` (coreutils, in the base image).
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvpool[operator]" \
 && rm -rf /wheels \
 && useradd --system --uid 65532 --home-dir /nonexistent --shell /usr/sbin/nologin kvpool
USER 65532:65532
ENV PYTHONUNBUFFERED=1
EXPOSE 7400 7401 8080 9090 9443
ENTRYPOINT ["kvpool"]
CMD ["--help"]
