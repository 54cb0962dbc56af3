# syntax=docker/dockerfile:1
# leasehold-demo-agent. Build context: the repository root:
#   docker build -f docker/demo-agent.Dockerfile -t leasehold/demo-agent:dev .
# The builder is pinned to bookworm so the binary's glibc matches distroless cc-debian12.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p leasehold-demo-agent \
 && cp target/release/leasehold-demo-agent /leasehold-demo-agent

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /leasehold-demo-agent /usr/local/bin/leasehold-demo-agent
ENTRYPOINT ["/usr/local/bin/leasehold-demo-agent"]
