# The distflow operator image: kopf + the spec model, no torch.
#   docker build -t distflow/operator:0.1.0 .
# The worker image (torch, the runtime) is worker_image/Dockerfile.
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY worker_image/distflow worker_image/distflow
COPY operator/distflow_operator operator/distflow_operator
# Dependencies at the versions requirements.lock pins (the lock .ci/setup installs too).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --prefix=/install -c requirements.lock ".[operator]"

FROM python:3.12-slim
COPY --from=build /install /usr/local
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin distflow
USER 10001:10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# 8080: /metrics (Prometheus), 8081: /healthz (liveness probe)
EXPOSE 8080 8081
ENTRYPOINT ["distflow-operator"]
