// gRPC server reflection, v1 and v1alpha (generic tools such as grpcurl and
// Postman ask either), answered from the file descriptors that generated
// code embeds: the services this server routes, their files and every file
// they import.

import { create, type DescFile, type DescService, toBinary } from "@bufbuild/protobuf";
import { nestedTypes } from "@bufbuild/protobuf/reflect";
import { FileDescriptorProtoSchema } from "@bufbuild/protobuf/wkt";
import { Code, type ConnectRouter } from "@connectrpc/connect";
import {
  type ServerReflectionRequest,
  ServerReflectionResponseSchema,
  ServerReflection as ServerReflectionV1,
} from "../../gen/grpc/reflection/v1/reflection_pb.js";
import {
  type ServerReflectionRequest as ServerReflectionRequestV1alpha,
  ServerReflectionResponseSchema as ServerReflectionResponseSchemaV1alpha,
  ServerReflection as ServerReflectionV1alpha,
} from "../../gen/grpc/reflection/v1alpha/reflection_pb.js";

interface Index {
  services: string[];
  files: Map<string, DescFile>;
  symbols: Map<string, DescFile>;
  /** "extendee:number" → file */
  extensions: Map<string, DescFile>;
  extensionNumbers: Map<string, number[]>;
}

type Answer =
  | { case: "fileDescriptorResponse"; value: { fileDescriptorProto: Uint8Array[] } }
  | { case: "listServicesResponse"; value: { service: { name: string }[] } }
  | {
      case: "allExtensionNumbersResponse";
      value: { baseTypeName: string; extensionNumber: number[] };
    }
  | { case: "errorResponse"; value: { errorCode: number; errorMessage: string } };

// Both versions share the shape of the request's oneof.
type Request = ServerReflectionRequest | ServerReflectionRequestV1alpha;

/**
 * Adds both reflection services to `router`. `services` is read on each
 * request, so it can list what the router holds once routing is complete.
 */
export function reflectionRoutes(router: ConnectRouter, services: () => readonly DescService[]) {
  let index: Index | undefined;
  const indexed = () => {
    index ??= buildIndex(services());
    return index;
  };

  router.service(ServerReflectionV1, {
    async *serverReflectionInfo(requests) {
      const sent = new Set<string>();
      for await (const req of requests) {
        yield create(ServerReflectionResponseSchema, {
          validHost: req.host,
          originalRequest: req,
          messageResponse: answer(indexed(), req, sent),
        });
      }
    },
  });
  router.service(ServerReflectionV1alpha, {
    async *serverReflectionInfo(requests) {
      const sent = new Set<string>();
      for await (const req of requests) {
        yield create(ServerReflectionResponseSchemaV1alpha, {
          validHost: req.host,
          originalRequest: req,
          messageResponse: answer(indexed(), req, sent),
        });
      }
    },
  });
}

function answer(index: Index, req: Request, sent: Set<string>): Answer {
  const r = req.messageRequest;
  switch (r.case) {
    case "listServices":
      return {
        case: "listServicesResponse",
        value: { service: index.services.map((name) => ({ name })) },
      };
    case "fileByFilename":
      return filesOf(index.files.get(r.value), `file ${r.value}`, sent);
    case "fileContainingSymbol":
      return filesOf(symbolFile(index, r.value), `symbol ${r.value}`, sent);
    case "fileContainingExtension":
      return filesOf(
        index.extensions.get(`${r.value.containingType}:${r.value.extensionNumber}`),
        `extension ${r.value.extensionNumber} of ${r.value.containingType}`,
        sent,
      );
    case "allExtensionNumbersOfType": {
      if (!index.symbols.has(r.value)) return notFound(`type ${r.value}`);
      return {
        case: "allExtensionNumbersResponse",
        value: {
          baseTypeName: r.value,
          extensionNumber: index.extensionNumbers.get(r.value) ?? [],
        },
      };
    }
    default:
      return {
        case: "errorResponse",
        value: { errorCode: Code.InvalidArgument, errorMessage: "no request in the message" },
      };
  }
}

// A method's name resolves to its service's file.
function symbolFile(index: Index, symbol: string): DescFile | undefined {
  const direct = index.symbols.get(symbol);
  if (direct) return direct;
  const dot = symbol.lastIndexOf(".");
  return dot > 0 ? index.symbols.get(symbol.slice(0, dot)) : undefined;
}

// The file and every file it imports that this stream has not sent yet.
function filesOf(file: DescFile | undefined, what: string, sent: Set<string>): Answer {
  if (!file) return notFound(what);
  const out: Uint8Array[] = [];
  const add = (f: DescFile, force: boolean) => {
    if (sent.has(f.proto.name) && !force) return;
    sent.add(f.proto.name);
    out.push(toBinary(FileDescriptorProtoSchema, f.proto));
    for (const dep of f.dependencies) add(dep, false);
  };
  add(file, true);
  return { case: "fileDescriptorResponse", value: { fileDescriptorProto: out } };
}

function notFound(what: string): Answer {
  return {
    case: "errorResponse",
    value: { errorCode: Code.NotFound, errorMessage: `${what} not found` },
  };
}

function buildIndex(services: readonly DescService[]): Index {
  const index: Index = {
    services: [...new Set(services.map((s) => s.typeName))].sort(),
    files: new Map(),
    symbols: new Map(),
    extensions: new Map(),
    extensionNumbers: new Map(),
  };
  const visit = (file: DescFile) => {
    // DescFile.name drops ".proto"; clients ask by the full file name.
    if (index.files.has(file.proto.name)) return;
    index.files.set(file.proto.name, file);
    for (const type of nestedTypes(file)) {
      index.symbols.set(type.typeName, file);
      if (type.kind === "extension") {
        const extendee = type.extendee.typeName;
        index.extensions.set(`${extendee}:${type.number}`, file);
        index.extensionNumbers.set(extendee, [
          ...(index.extensionNumbers.get(extendee) ?? []),
          type.number,
        ]);
      }
    }
    for (const dep of file.dependencies) visit(dep);
  };
  for (const service of services) visit(service.file);
  return index;
}
