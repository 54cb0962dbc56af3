# syntax=docker/dockerfile:1
# leasehold-sidecar. Build context: the repository root:
#   docker build -f docker/sidecar.Dockerfile -t leasehold/sidecar:dev .
# The builder is pinned to bookworm so the binary's glibc matches distroless cc-debian12.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The commit shown by the leasehold_build_info metric: --build-arg LEASEHOLD_GIT_COMMIT=$(git rev-parse HEAD).
ARG LEASEHOLD_GIT_COMMIT=""
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p leasehold-sidecar \
 && cp target/release/leasehold-sidecar /leasehold-sidecar

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /leasehold-sidecar /usr/local/bin/leasehold-sidecar
ENTRYPOINT ["/usr/local/bin/leasehold-sidecar"]
