# One image holds both binaries: /manager (the operator, the entrypoint) and
# /relay (what relay pods run; the operator sets command: ["/relay"]).
#
#   docker build --build-arg VERSION=v0.1.0 -t ghcr.io/outbox-relay/outbox-operator:v0.1.0 .
#
# `make images` builds the same image without Docker (hack/images). Its tests
# parse this file and hold the two in step: the go build flags and env below,
# the COPY destinations, USER, WORKDIR, EXPOSE and ENTRYPOINT, and the base
# (hack/images writes the distroless files the binaries rely on itself). A
# change here fails them until hack/images makes the same change.

FROM golang:1.26 AS build
ARG VERSION=latest
ARG TARGETOS=linux
ARG TARGETARCH
WORKDIR /src
# Dependencies first, so source edits reuse the module cache layer.
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/ cmd/
COPY controllers/ controllers/
COPY relay/ relay/
COPY outbox/ outbox/
COPY relayconfig/ relayconfig/
COPY dbauth/ dbauth/
COPY kafkaauth/ kafkaauth/
COPY version/ version/
ENV CGO_ENABLED=0
RUN GOOS=$TARGETOS GOARCH=$TARGETARCH go build -trimpath -buildvcs=false -ldflags "-s -w -X github.com/outbox-relay/outbox-operator/version.Version=${VERSION}" -o /out/manager ./cmd/manager && \
    GOOS=$TARGETOS GOARCH=$TARGETARCH go build -trimpath -buildvcs=false -ldflags "-s -w -X github.com/outbox-relay/outbox-operator/version.Version=${VERSION}" -o /out/relay ./cmd/relay

# Static binaries on distroless: no shell, no package manager, user 65532.
FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=latest
LABEL org.opencontainers.image.title=outbox-operator
LABEL org.opencontainers.image.description="Kubernetes operator for transactional-outbox relays (PostgreSQL to Kafka); /manager and /relay"
LABEL org.opencontainers.image.source=https://github.com/outbox-relay/outbox-operator
LABEL org.opencontainers.image.licenses=Apache-2.0
LABEL org.opencontainers.image.version=${VERSION}
# The nonroot base's working directory is /home/nonroot; the programs use none.
WORKDIR /
COPY --from=build /out/manager /manager
COPY --from=build /out/relay /relay
USER 65532:65532
EXPOSE 8443 8081 9090
ENTRYPOINT ["/manager"]
