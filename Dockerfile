# kvscope image for docker-compose.yml (no vLLM inside: the pods run their own images).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .
EXPOSE 8501 8800 5557
CMD ["kvscope", "--help"]
